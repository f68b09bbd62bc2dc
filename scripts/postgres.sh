#!/usr/bin/env bash
# A throwaway PostgreSQL on 127.0.0.1 for the MLflow backend-store tests (Debian's packages).
#   bash scripts/postgres.sh start DIR   # prints the database URI on stdout
#   bash scripts/postgres.sh stop DIR
set -euo pipefail
action=$1
data=$2
port=${POSTGRES_TEST_PORT:-55432}

bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
as_owner=()
if [ "$(id -u)" = 0 ]; then as_owner=(runuser -u postgres --); fi

if [ "$action" = stop ]; then
  [ -n "$bin" ] && [ -d "$data/db" ] && "${as_owner[@]}" "$bin/pg_ctl" -D "$data/db" -m fast stop >&2 || true
  exit 0
fi

if [ -z "$bin" ]; then
  echo "postgres: installing Debian's postgresql" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
fi
rm -rf "$data"
mkdir -p "$data"
if [ "$(id -u)" = 0 ]; then chown postgres: "$data"; fi
"${as_owner[@]}" "$bin/initdb" -D "$data/db" --auth=trust -U postgres >/dev/null
"${as_owner[@]}" "$bin/pg_ctl" -D "$data/db" -l "$data/server.log" -w \
  -o "-p $port -k $data -c listen_addresses=127.0.0.1" start >&2
"${as_owner[@]}" "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres mlflow
echo "postgresql://postgres@127.0.0.1:$port/mlflow"
