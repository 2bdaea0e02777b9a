"""Device-machine quirks only (the lent H200 image), imported at Python start-up.

On the H200 image transformers is 5.17 while SGLang 0.5.17 expects 5.12.1:
SGLang registers configs ('qwen3_asr', ...) that 5.17 already ships, and
``AutoConfig.register`` refuses duplicates. Registering with
``exist_ok=True`` is what DEVICE_NOTES.md found sufficient. Nothing here is
part of the product; it is on PYTHONPATH only in bench/device scripts.
"""

try:
    from transformers.models.auto import configuration_auto as _ca

    _orig_register = _ca._LazyConfigMapping.register

    def _register(self, key, value, exist_ok=False):
        return _orig_register(self, key, value, exist_ok=True)

    _ca._LazyConfigMapping.register = _register
except Exception:  # transformers missing: nothing to fix
    pass
