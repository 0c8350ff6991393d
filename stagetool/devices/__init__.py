"""Devices: the :class:`~stagetool.plan.Plan`'s target made real as a ``jax.sharding.Mesh``.

Simulated CPU devices, attached GPUs/TPUs, compile-only TPU topologies (:mod:`.tpu_topology`) and
GPU targets (:mod:`.gpu_topology`); :func:`.provision.provision_devices` hands the next stage a
:class:`~.provision.DeviceSetup`. Only the JAX backends a run uses are started (:mod:`.backends`).
"""
