"""Where conversion/ still imports `GPTArchitecture` from; it lives in `config/architecture.py`
(the model's shape is part of the schema, and config/ sits below models/).

Only conversion/ imports this module: that room is being reworked on another branch, so its
import lines move there, and then this file goes (tests/test_import_graph.py lists it).
"""

from megatron_kto.config.architecture import GPTArchitecture

__all__ = ["GPTArchitecture"]
