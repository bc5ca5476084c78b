"""Static key/value cache layers that store what the model hands them, in the
cache's dtype, for decoders whose model runs under autocast.

Note [A static cache under autocast]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model prepared by accelerate with ``mixed_precision="bf16"`` (TRL's
GRPOTrainer with ``bf16=True``, the HF Trainer) runs every forward under
``torch.autocast``: its projections come out in bf16, while rotary embeddings
multiply the keys by fp32 cosines, so a Llama layer hands its cache fp32 keys
and bf16 values. transformers' DynamicCache concatenates whatever it gets;
its StaticLayer copies into tensors of one dtype with ``index_copy_``, which
refuses another dtype, so ``model.generate(cache_implementation="static")``
fails there, and graphed's decoders (which allocate the StaticCache in the
model's dtype) would too. The layers here convert the new states to the
cache's dtype before transformers' update. With fp32 weights the cache is
fp32, and bf16 values widen exactly; attention reads them back and autocast
narrows them to bf16 again for SDPA, as it narrows the DynamicCache's, so the
tokens are those of TRL's default path. The conversion is one elementwise
kernel per layer and step, and only where the dtypes differ.
"""

import functools


@functools.lru_cache(maxsize=None)
def _converting_layer_class(base):
    class ConvertingStaticLayer(base):
        """transformers' StaticLayer, taking states of any floating dtype
        (Note [A static cache under autocast])."""

        def update(self, key_states, value_states, *args, **kwargs):
            if self.is_initialized:
                if key_states.dtype != self.keys.dtype:
                    key_states = key_states.to(self.keys.dtype)
                if value_states.dtype != self.values.dtype:
                    value_states = value_states.to(self.values.dtype)
            return super().update(key_states, value_states, *args, **kwargs)

    ConvertingStaticLayer.__name__ = base.__name__
    ConvertingStaticLayer.__qualname__ = base.__qualname__
    return ConvertingStaticLayer


def convert_states_to_cache_dtype(cache):
    """Makes every StaticLayer of ``cache`` convert incoming keys and values to
    its own dtype (Note [A static cache under autocast]); other layers (state
    layers) are left as they are. Returns ``cache``."""
    from transformers.cache_utils import StaticLayer

    for layer in cache.layers:
        if type(layer) is StaticLayer:
            layer.__class__ = _converting_layer_class(StaticLayer)
    return cache
