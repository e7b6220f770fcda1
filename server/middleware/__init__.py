"""Pure-ASGI middleware, one concern per module, outermost first:

- `access`: times, counts and logs every request; makes the request's state (`server.request_state`);
- `auth`: API keys on the API (naming the request's tenant), admin keys on /admin/*;
- `body_limit`: 413 for bodies over `limits.max_body_bytes`;
- `tenant_limits`: a tenant's model allow-list, rate limits and budget, and what it used;
- `asgi`: the raw ASGI responses and body reading they share.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, so streamed responses are never buffered.
The middleware is the only layer that authenticates a request and asks the tenant limiter
(`server.tenants`); routes and serving never see a tenant.
"""
