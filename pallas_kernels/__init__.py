"""specjax's Pallas kernels, one op per sub-package (see README.md)."""
