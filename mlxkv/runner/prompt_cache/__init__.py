"""The prompt cache: conversations' cache entries matched by longest common prefix (`pool`), kept
within a count and a byte budget (`fit`, `holdings`), and the memory report read from them.

Owns policy (which entry a request uses, what is evicted); the K/V mechanism it holds lives in
`mlxkv.cache`, the files it spills to in `mlxkv.runner.disk`.
"""
