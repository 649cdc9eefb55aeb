"""CPU kernels (XLA FFI) beside their jnp references: the streaming matmul and packed weights."""
