"""`rollout serve`: the OpenAI-compatible server: its HTTP half (`server`), the state next to the
engine (`desk`), one process or several (`frontends`), its reading, auth and listening (`io`),
OpenAI's wire format (`openai_api`) and vLLM's RL routes (`rl_routes`).
"""

from rollout.serve.desk import Desk, ServedEngine
from rollout.serve.frontends import FrontEnds, serve
from rollout.serve.server import Server

__all__ = ["Desk", "FrontEnds", "ServedEngine", "Server", "serve"]
