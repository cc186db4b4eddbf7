"""The optimized engine's device data plane (torch; CUDA when present):
:mod:`.device_tables` (block tables uploaded by delta), :mod:`.slot_mapping`,
:mod:`.nvrtc_kernels` and :mod:`.data_plane`, over :mod:`paged`'s caches and attention.
It imports nothing from :mod:`optimized.control`: the manager's tables reach it through
the :class:`.device_tables.HostTable` protocol."""
