"""The disk tier: cache entries kept in files under a byte budget, loaded back when that is faster
than prefill. Owns the file format (`files`), which files go first (`budget`) and the background
writer and loader (`store`); the arrays' layout comes from `mlxkv.cache.serialize`.
"""
