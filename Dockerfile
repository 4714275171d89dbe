# The trainguard image: worker, node agent and sinks (the trainer side installs with pip).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY trainguard trainguard
COPY producers producers
COPY schemas schemas
COPY streams streams
COPY sinks sinks
COPY rules rules
RUN pip install --no-cache-dir '.[worker,node]'
USER nobody
ENTRYPOINT ["trainguard"]
CMD ["worker"]
