"""Align a GPT/Llama model with KTO.

    torchrun --nproc_per_node N examples/train_gpt_kto.py [hydra overrides]

With no overrides (and no GPU) it trains the bundled tiny example on CPU.
"""

import hydra

from megatron_kto.config.schema import register
from megatron_kto.config.validate import run_entry_point

register()


@hydra.main(config_path="../conf", config_name="gpt_kto", version_base="1.3")
def train(cfg) -> None:
    from megatron_kto.run import main  # imports megatron-core: after the config is composed

    main(cfg, "kto")


if __name__ == "__main__":
    run_entry_point(train)  # a config Hydra cannot compose: one `error:` line, exit 2
