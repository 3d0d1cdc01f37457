"""Per-model-family KV layouts and the codecs that cut and rebuild each layer kind.

A family declares, from the model's config, what each cache entry of
`model.make_cache()` holds (full attention, a sliding window of W, recurrent
state, or quantized K/V). Codecs are looked up by that spec's type, never by
model name, so adding a family is a layout function and nothing else.
"""
