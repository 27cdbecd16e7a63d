"""The adapters: MindSpeed-RL and the TransferQueue drop-in."""
