"""A local Ray for one test module's fakes."""

from __future__ import annotations



def ray_session_for(module_name: str):
    """A local Ray for a module's tests (a module-scoped fixture yields from this), shut down after
    them if they started it; the module's fakes are pickled by value (workers cannot import tests/)."""
    import sys

    import ray
    from ray import cloudpickle

    from megatron_specrl.cluster.actors import init_ray
    from megatron_specrl.config import RayConfig
    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    started = init_ray(RayConfig(num_cpus=2))
    yield ray
    if started:
        ray.shutdown()


