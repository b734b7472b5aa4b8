"""A front-end process of `rollout serve` (`serve.api_servers` > 1), started by
`rollout.serve.frontends.FrontEnds` with its settings pickled on stdin."""

import pickle
import sys

import anyio

from rollout.log import configure
from rollout.serve.frontends import front_end

if __name__ == "__main__":
    # (index, socket fd, pipe fd, backend address, Config, model path, API key)
    settings = pickle.load(sys.stdin.buffer)
    configure(settings[4].logging.level, settings[4].logging.json)
    anyio.run(front_end, *settings)
