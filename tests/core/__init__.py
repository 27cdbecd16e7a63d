"""The dock's API, the Lua loader, the row codec and the wire, and a dock's checkpoints."""
