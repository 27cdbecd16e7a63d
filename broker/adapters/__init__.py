"""Other systems' APIs answered with the dock's public API only: MindSpeed-RL's ``mindspeed``."""
