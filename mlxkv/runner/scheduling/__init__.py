"""Where and when a Runner's work runs: the one `engine` thread of its MLX work, requests
dispatched to it alone or interleaved in the decode batch's `slots` (`dispatch`), and sharded
ranks kept in step (`lockstep`). Does not own what a request does on the model
(`mlxkv.runner.request_run`) or building it (`mlxkv.runner.request_builder`).
"""
