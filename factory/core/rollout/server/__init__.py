"""The rollout server: an OpenAI-compatible HTTP API over an embedded engine (`app.py` declares the routes and
launches it; `api.py` is the request handling behind them; the body and prompt gates, chat template and tool calls,
log-probs, sessions and weight-update decoders are one module each). Nothing here is imported until asked for:
importing this package does not import FastAPI."""
