"""``python -m torchrl_agent.envs.search [--host H] [--port P]``: serve BM25 over the Wikipedia summaries."""

from torchrl_agent.envs.search.server import main

main()
