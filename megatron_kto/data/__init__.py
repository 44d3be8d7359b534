"""KTO/DPO data pipeline: files in, exactly the batches the loss math needs out.

Import from the submodules (this package imports nothing, so tools that only validate data
start without loading torch):

* ``readers``       — rows from JSONL (streamed), JSON, Parquet, ``datasets`` directories
* ``formats``       — TRL unpaired / NeMo-Aligner / paired / conversational rows -> examples
* ``errors``        — ``DataFormatError``: one line ``file:line: field: problem``
* ``tokenizers``    — ``Tokenizer`` protocol, SentencePiece and HF backends, ``load_tokenizer``
* ``chat_template`` — sandboxed Jinja chat templates
* ``encoding``      — prompt/completion ids with an exact boundary, BOS/EOS rules
* ``length_policy`` — truncation and drop rules
* ``shards``        — one file tokenised into flat int32 buffers
* ``cache``         — content-keyed, atomic, memory-mapped cache of shards
* ``dataset``       — ``KTODataset``/``DPODataset``, ``build_kto_dataset``/``build_dpo_dataset``
* ``stats``         — ``DatasetStats``, KTO class-balance advice
* ``collate``       — ``kto_custom_collate``/``dpo_custom_collate`` (the model's input contract)
* ``samplers``      — Megatron-style global-batch samplers with DP sharding, ``build_dataloader``
* ``inspection``    — logic of ``tools/preprocess_kto_data.py``
* ``synthetic``     — the bundled example task
"""
