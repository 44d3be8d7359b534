# GPU image: NGC PyTorch (CUDA, NCCL, Transformer Engine preinstalled) + megatron_kto.
#   docker build -t megatron_kto .
#   docker run --gpus all --rm -it megatron_kto \
#     torchrun --nproc_per_node 8 examples/train_gpt_kto.py model=llama3_8b trainer.precision=bf16 ...
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /workspace/megatron_kto
COPY setup.py pyproject.toml README.md ./
COPY megatron_kto ./megatron_kto
# The container's torch and transformer-engine are kept; only our other dependencies are added.
RUN pip install --no-cache-dir -e '.[tensorboard,parquet]'
COPY conf ./conf
COPY examples ./examples
COPY tools ./tools
COPY tests ./tests

CMD ["bash"]
