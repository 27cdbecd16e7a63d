"""What holds the house together: the planes, the public names, packaging, the docs."""
