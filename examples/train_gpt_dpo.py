"""Align a GPT/Llama model with DPO.

    torchrun --nproc_per_node N examples/train_gpt_dpo.py [hydra overrides]

With no overrides (and no GPU) it trains the bundled tiny paired example on CPU.
"""

import hydra

from megatron_kto.config.schema import register
from megatron_kto.run import main

register()


@hydra.main(config_path="../conf", config_name="gpt_dpo", version_base="1.3")
def train(cfg) -> None:
    main(cfg, "dpo")


if __name__ == "__main__":
    train()
