"""Multi-turn episodes: the loop of turns (`loop`), environments and their steps (`env`), chat
templates and vLLM's tool and reasoning parsers for a turn's text (`chat`), example environments
(`examples`, named in configs as `env: rollout.episodes.examples:Calculator`).
"""

from rollout.episodes.chat import ChatRenderer, chat_renderer
from rollout.episodes.env import Action, EnvError, EnvFactory, Step, load_env
from rollout.episodes.loop import assemble, run_episode

__all__ = [
    "Action",
    "ChatRenderer",
    "EnvError",
    "EnvFactory",
    "Step",
    "assemble",
    "chat_renderer",
    "load_env",
    "run_episode",
]
