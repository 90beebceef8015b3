"""The hooks of ``get_model`` on megatron-core 0.19's model builders.

Megatron-LM's ``pretrain_gpt.py`` of ``core_r0.19`` hands ``pretrain`` a config container with
a model config, and ``setup_model_and_optimizer`` then builds the model with
``GPTModelBuilder.build_distributed_models`` (each model chunk by ``build_model(pg_collection,
pre_process=, post_process=, vp_stage=)``, then Megatron's wrappers) instead of ``get_model``.
What the hooks do around ``get_model`` (a mesh plan's pre- and post-process by the model's
global stage, its stage modules, gradient scale and communicator; a format-1 plan's per-chunk
stage settings) is done here around the builder, through the same wrapper: the builder's
``build_model`` is the model provider, the builder's own ``build_distributed_models`` is
``get_model``. Installed only where :func:`.releases.has` ``("model_builders")``.
"""

from __future__ import annotations

import functools

__all__ = ["wrap_builders"]


def _through_get_model_hook(wrap_get_model):
    """``make`` for ``build_distributed_models``: the builder run as ``get_model`` under the
    hooks' ``wrap_get_model``."""
    def make(original):
        @functools.wraps(original)
        def build_distributed_models(self, pg_collection, *a, **kw):
            own = self.build_model

            def model_provider(pre_process=None, post_process=None, vp_stage=None,
                               pg_collection=None, **more):
                return own(pg_collection, pre_process=pre_process, post_process=post_process,
                           vp_stage=vp_stage, **more)

            def as_get_model(provider, *_a, **_kw):
                def build_model(pg, pre_process=None, post_process=None, vp_stage=None, **more):
                    return provider(pre_process=pre_process, post_process=post_process,
                                    vp_stage=vp_stage, pg_collection=pg, **more)

                self.build_model = build_model  # what the builder calls for each chunk
                try:
                    return original(self, pg_collection, *a, **kw)
                finally:
                    del self.build_model
            return wrap_get_model(as_get_model)(model_provider)
        return build_distributed_models
    return make


def wrap_builders(wrap_get_model) -> None:
    """Hook ``GPTModelBuilder.build_distributed_models`` as ``get_model`` is hooked by
    ``wrap_get_model`` (``hooks._wrap_get_model``)."""
    from megatron.training.models.gpt import GPTModelBuilder

    from ..mcore.rebind import wrap_method

    wrap_method(GPTModelBuilder, "build_distributed_models",
                _through_get_model_hook(wrap_get_model), layer="hooks")
