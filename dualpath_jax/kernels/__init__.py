"""Attention kernels over KV rows held in pages, beneath the model.

- `kernels.kv_rows`: where each KV head's key and value sit in a KV row (`RowLayout`), the rows'
  fp8 scales, and their bits (`bits_dtype`).
- `kernels.paged_attention`: the Pallas kernel over a request's live pages (`paged_attention`),
  the XLA page write (`write_pages`) and gather, and the kernel's dense oracle
  (`paged_attention_reference`).
- `kernels.dense_attention`: grouped-query attention over materialized keys and values
  (`attend`), what the `reference` and `xla` backends run.

These modules take arrays and a `RowLayout` and import nothing of the package but `config`; the
model (`model/layers.py`) chooses the backend and calls them.
"""
