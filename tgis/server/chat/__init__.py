"""The chat turn the chat APIs share: the prompt a chat template makes, reasoning, tool
formats and tool calls, and one turn answered in typed parts."""
