"""The SGLang engine: every call into SGLang's API is in this folder (the version-pinned change to SGLang
itself is patches/sglang_0_5_23_tree_proposer.py).

- engine.py: SGLangEngine (an in-process `sglang.Engine`) and SGLangHTTPEngine (a running server);
- requests.py: our requests as SGLang's, its answers as our results (pure: tested on CPU with fakes);
- server.py: the server's arguments and environment for tree drafting, and the plugin check.
"""

from megatron_specrl.engines.sglang.engine import SGLangEngine, SGLangHTTPEngine
from megatron_specrl.engines.sglang.requests import (
    BAN_PARAM, SGLANG_SAMPLING_EPS, ban_processor_str, build_generate_payload, build_score_payload, check_temperature,
    parse_generate_response, parse_score_response,
)
from megatron_specrl.engines.sglang.server import (
    PLUGIN_GROUP, PLUGIN_NAME, check_plugin_installed, tree_server_args, tree_server_env,
)

__all__ = ["BAN_PARAM", "PLUGIN_GROUP", "PLUGIN_NAME", "SGLANG_SAMPLING_EPS", "SGLangEngine", "SGLangHTTPEngine",
           "ban_processor_str", "build_generate_payload", "build_score_payload", "check_plugin_installed",
           "check_temperature", "parse_generate_response", "parse_score_response", "tree_server_args",
           "tree_server_env"]
