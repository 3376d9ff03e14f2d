"""Adapters that plug flashtriton into other libraries; each imports its library only when used."""
