"""Tenants: the key directory (who a presented key belongs to; the keys file itself is read by
`server.settings.keys_file`), the rate limiter (in memory or in Redis, behind one Protocol), the
usage store (SQLite), the wording of refusals, and the `keys` / `usage` sub-commands.

Only the middleware authenticates and asks the limiter; `server.serving` never sees a tenant.
"""
