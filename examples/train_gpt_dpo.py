"""Align a GPT/Llama model with DPO.

    torchrun --nproc_per_node N examples/train_gpt_dpo.py [hydra overrides]

With no training data and no checkpoint it trains the bundled tiny paired example (CPU is enough).
A NeMo-Aligner gpt_dpo.yaml works as it is: `--config-path DIR --config-name NAME`.
"""

import hydra

from megatron_kto.config.schema import register
from megatron_kto.entry import run_entry_point, run_training

register()


@hydra.main(config_path="../conf", config_name="gpt_dpo", version_base="1.3")
def train(cfg) -> None:
    # The config is checked (against the checkpoint's architecture too) before megatron-core
    # is imported; a user error is one `error:` line from rank 0 and exit code 2.
    run_training(cfg, "dpo")


if __name__ == "__main__":
    run_entry_point(train)  # a config Hydra cannot compose: one `error:` line, exit 2
