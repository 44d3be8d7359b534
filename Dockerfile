# GPU image: NGC PyTorch 25.11 (CUDA 13.0, PyTorch 2.10.0a0, Transformer Engine 2.9, NCCL) plus
# megatron-core 0.16.1 and megatron_kto.
#
# Why this base: megatron-core 0.16.1 requires torch>=2.6.0 and is tested with Transformer Engine
# >=2.9,<2.12 (its `dev` extra). NGC 25.01 ships torch 2.6.0a0, a pre-release that pip ranks
# *below* 2.6.0, so installing megatron-core there replaced the image's torch with a PyPI wheel
# (and broke TE and Apex, built against it). 25.11's 2.10.0a0 satisfies >=2.6.0 and its TE 2.9
# is in the tested range. Since 25.03 NGC images pin every preinstalled package in
# /etc/pip/constraint.txt; every pip install below runs under it, so pip can add packages but
# never re-resolve torch / Transformer Engine / Apex: a conflict fails the build instead. The
# build also compares the GPU stack before and after installing.
#
#   docker build -t megatron_kto .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#     -v /data:/data -v /ckpt:/ckpt megatron_kto \
#     torchrun --nproc_per_node 8 examples/train_gpt_kto.py trainer.precision=bf16 ...
# Multi-node (torchrun rendezvous, SLURM srun): README.md, "GPUs".
# First thing to run in the image (the user paths on the GPU, under 8 minutes on one GPU):
#   bash tools/gpu_acceptance.sh
#
# The base tag and the torch / Transformer Engine versions it ships (NGC release notes; `pip
# list` in the image, local version parts dropped), stated once: tests/test_dockerfile.py checks
# them against megatron-core's requirements, and the first RUN below against the image itself.
ARG NGC_TAG=25.11
ARG NGC_TORCH=2.10.0a0
ARG NGC_TRANSFORMER_ENGINE=2.9.0
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}-py3
ARG NGC_TORCH
ARG NGC_TRANSFORMER_ENGINE

ENV PYTHONUNBUFFERED=1
WORKDIR /workspace/megatron_kto

# The GPU stack as the image ships it (recorded before anything is installed), and the stated
# versions checked against it.
RUN python -c "import importlib.metadata as m, sys; \
got = {d: m.version(d).split('+')[0] for d in ('torch', 'transformer_engine')}; \
want = {'torch': '${NGC_TORCH}', 'transformer_engine': '${NGC_TRANSFORMER_ENGINE}'}; \
sys.exit(None if got == want else f'Dockerfile ARGs state {want}, the image has {got}')" \
    && test -f /etc/pip/constraint.txt \
    && pip list --format=freeze \
       | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*|apex|nvidia-nccl[-a-z0-9]*)==' \
       | sort > /opt/gpu_stack.txt \
    && grep -iq '^torch==' /opt/gpu_stack.txt \
    && grep -iq '^transformer[-_]engine' /opt/gpu_stack.txt \
    && cat /opt/gpu_stack.txt

COPY setup.py pyproject.toml README.md ./
COPY megatron_kto ./megatron_kto
# megatron-core pinned to the version CI tests; our other dependencies under the constraints.
RUN pip install --no-cache-dir --constraint /etc/pip/constraint.txt "megatron-core==0.16.1" \
    && pip install --no-cache-dir --constraint /etc/pip/constraint.txt -e '.[tensorboard,parquet]' \
    && pip list --format=freeze \
       | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*|apex|nvidia-nccl[-a-z0-9]*)==' \
       | sort | diff /opt/gpu_stack.txt - \
    && python -c "import importlib.metadata as m; print('megatron-core', m.version('megatron-core'))" \
    && python -c "import sys; from megatron_kto.runtime.gpu_settings import Accelerator, \
transformer_engine_warning as check; sys.exit(check(Accelerator.detect().transformer_engine))"

COPY conf ./conf
COPY examples ./examples
COPY tools ./tools
COPY tests ./tests

CMD ["bash"]
