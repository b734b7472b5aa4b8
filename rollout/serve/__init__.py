"""`rollout serve`: the OpenAI-compatible server (`server`), its reading, auth and listening
(`io`), OpenAI's wire format (`openai_api`) and vLLM's RL routes (`rl_routes`).
"""

from rollout.serve.server import ServedEngine, Server

__all__ = ["ServedEngine", "Server"]
