"""A reply as every API sees it, whatever API asked for it: one generation (`turn`, started
from a prompt prepared once by `start`; a request's several, `choices`), its text
split into thinking (`thinking_split`) and tool calls (`tool_calls`), the chat-template
switches each API's thinking setting becomes (`thinking_switch`), and the grammars that keep
a reply to a schema (`structured`) or to a required tool call (`forced_tools`). The API
folders only translate their bodies to these and back.
"""
