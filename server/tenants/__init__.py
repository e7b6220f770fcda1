"""Tenants: the keys file (who a key belongs to and its limits), the rate limiter (in memory or
in Redis, behind one Protocol) and the usage store (SQLite).

Only `server.middleware` authenticates and asks the limiter; `server.serving` never sees a
tenant. Kept import-free so that `server.settings` can validate a keys file through
`server.tenants.keys` without pulling in the rest.
"""
