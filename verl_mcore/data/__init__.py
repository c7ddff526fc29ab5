"""Prompt datasets (Parquet / Arrow IPC / JSON Lines through pyarrow) and prompt batches.

    from verl_mcore.data import build_dataset, PromptLoader
    ds = build_dataset(cfg.data.train_files, tokenizer, cfg.data)     # checks + tokenises
    loader = PromptLoader(ds, cfg.data.train_batch_size, rank=dp_rank, world_size=dp_size,
                          seed=data_seed(cfg), shuffle=cfg.data.shuffle)  # config/seeds.py

`RLHFDataset` is the class a custom dataset subclasses (override `read_file`, or verl's
`_read_files_and_tokenize` setting `self.dataframe`; see dataset.py).
"""
from verl_mcore.data.dataset import DatasetStats, RLHFDataset, build_dataset, load_dataset_class
from verl_mcore.data.errors import BadRow, DataError
from verl_mcore.data.loader import PromptBatch, PromptLoader

__all__ = ["BadRow", "DataError", "DatasetStats", "PromptBatch", "PromptLoader", "RLHFDataset",
           "build_dataset", "load_dataset_class"]
