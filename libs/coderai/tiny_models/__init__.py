"""The tiny models coderai builds itself, offline: the defaults `coderai up` serves before any real model is
configured (coderai.defaults), also used by tests and benches.

- `llm`: a random-weight llama GGUF with a real byte-level BPE tokenizer (the `llama` extra)
- `whisper`: a tiny Whisper overfitted on one phrase spoken by espeak-ng, as CTranslate2 (the `whisper` extra)
- `diffusion`: tiny random Stable Diffusion and text-to-video pipelines (the `diffusers` extra)
- `cache`: where built models are kept (`$CODERAI_MODEL_CACHE`), written atomically
- `speech`: espeak-ng speech as 16 kHz samples, what the whisper builder trains on
"""
