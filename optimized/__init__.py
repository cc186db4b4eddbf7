"""The optimized implementation of the reference's contract (vLLM 0.33 policy, exact).

Two planes:

* :mod:`optimized.control` (numpy): hashing, requests, the block pool, one manager per
  attention type, the coordinators, the request-level manager with its batched
  ``schedule_step`` (:mod:`optimized.control.batched_decode`);
* :mod:`optimized.device` (torch; CUDA when present): device block tables, slot mapping,
  NVRTC kernels and the data plane, over the paged caches and paged attention of the
  neutral package :mod:`paged`.

The control plane imports nothing from the device plane, and the device plane reads the
control plane only through :class:`optimized.device.device_tables.HostTable` (duck typed).
Exposed as the ``optimized`` engine by :mod:`properties.engines.optimized`.
"""
