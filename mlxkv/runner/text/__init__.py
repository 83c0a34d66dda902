"""Text in and out of the request path: prompts (text, token ids or chat messages) into token ids
(`prompt`; chat `messages` and tools, rendered `segments`, what the tokenizer is made of:
`tokenizer_facts`; replies sent back as their generated ids: `replies`; images: `vision`,
cut at message boundaries: `vision_cuts`), and sampled tokens back into streamed text chunks
with stop strings (`chunks`, `stop_strings`).
"""
