"""Faults: lost replies, deadlines, persistence, hostile calls, what a dock needs of its server, tenants."""
