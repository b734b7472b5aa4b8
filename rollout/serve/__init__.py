"""`rollout serve`: the OpenAI-compatible server: its HTTP half (`server`), the state next to the
engine (`backend`), one process or several (`frontends`), reading bodies (`bodies`), preparing
requests off the loop (`prepare`), the API key (`auth`), the listening socket (`listen`),
OpenAI's wire format (`openai_api`) and vLLM's RL routes (`rl_routes`).
"""

from rollout.serve.backend import Backend, ServedEngine
from rollout.serve.frontends import FrontEnds, serve
from rollout.serve.server import Server

__all__ = ["Backend", "FrontEnds", "ServedEngine", "Server", "serve"]
