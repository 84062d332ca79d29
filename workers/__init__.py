"""Math on a device: models, layers, attention kernels, the worker, sampler and catalog.

Imports kvstore only."""
