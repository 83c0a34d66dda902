"""Text in and out of the request path: prompts (text, token ids or chat messages) into token ids
(`prompt`), and sampled tokens back into streamed text chunks with stop strings (`chunks`,
`stop_strings`).
"""
