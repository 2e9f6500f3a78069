# syntax=docker/dockerfile:1
# One image for every turnlog service: a container runs `turnlog <service>` (compose.yaml
# says which). The toolchain stays in the build stage; the runtime image holds the binary,
# CA certificates (for an https model gateway), curl (for the ingress healthcheck) and
# poppler-utils (the ingress reads uploaded PDFs with its pdftotext).
# Container builds are not exercised by CI.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# The cache mounts keep downloaded crates and compiled dependencies between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p turnlog \
    && install -m 0755 target/release/turnlog /usr/local/bin/turnlog

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl poppler-utils \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin turnlog \
    && install -d -o turnlog -g turnlog /var/lib/turnlog/files
COPY --from=build /usr/local/bin/turnlog /usr/local/bin/turnlog
USER turnlog
ENV TURNLOG_LOG_FORMAT=json RUST_LOG=info
ENTRYPOINT ["turnlog"]
CMD ["--help"]

# `turnlog tools` with Node.js and the reference filesystem MCP server (compose's `tools`
# profile); other servers are added the same way, or reached over streamable HTTP.
FROM runtime AS tools
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends nodejs npm \
    && npm install -g --no-audit --no-fund @modelcontextprotocol/server-filesystem@2026.8.31 \
    && rm -rf /var/lib/apt/lists/* /root/.npm \
    && install -d -o turnlog -g turnlog /var/lib/turnlog/workspace
USER turnlog

# The default target: every other service.
FROM runtime
