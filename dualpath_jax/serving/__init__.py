"""OpenAI-compatible HTTP serving: `ApiServer` (aiohttp) over a router's `Client`, Prometheus
metrics, tokenizers (a Hugging Face checkpoint's, or bytes for the tiny presets).

    python launch/api_server.py --config=configs/cpu_1p2d.py --workdir=/tmp/dp_api

Needs the `serve` extra (`pip install 'dualpath_jax[serve]'`); docs/serving.md.
"""
