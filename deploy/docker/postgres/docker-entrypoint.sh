#!/bin/sh
# The official postgres image's first-start contract, on Debian's PostgreSQL: with an empty $PGDATA,
# initdb as $POSTGRES_USER (default postgres) with $POSTGRES_PASSWORD (required unless
# POSTGRES_HOST_AUTH_METHOD=trust), create $POSTGRES_DB (default: the user's name), run
# /docker-entrypoint-initdb.d/*.sql and *.sh, then serve on all addresses with password authentication.
set -eu
PGDATA=${PGDATA:-/var/lib/postgresql/data}
if [ "${1:-postgres}" != postgres ]; then exec "$@"; fi
if [ "$(id -u)" = 0 ]; then  # as root: own the data folder, then run this script again as postgres
  mkdir -p "$PGDATA" /var/run/postgresql
  chown postgres:postgres "$PGDATA" /var/run/postgresql
  chmod 700 "$PGDATA"
  exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" "$@"
fi
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
auth=${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ] && [ "$auth" != trust ]; then
    echo "postgres: POSTGRES_PASSWORD is not set (or set POSTGRES_HOST_AUTH_METHOD=trust)" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-}" >"$pwfile"
  initdb --username="$user" --pwfile="$pwfile" --auth-local=trust --auth-host="$auth" >/dev/null
  rm -f "$pwfile"
  printf "listen_addresses = '*'\n" >>"$PGDATA/postgresql.conf"
  printf 'host all all all %s\n' "$auth" >>"$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
  if [ "$db" != postgres ]; then
    psql -v ON_ERROR_STOP=1 --username "$user" --dbname postgres -q \
      -c "CREATE DATABASE \"$db\"" >/dev/null
  fi
  for f in /docker-entrypoint-initdb.d/*; do
    case "$f" in
      *.sql) psql -v ON_ERROR_STOP=1 --username "$user" --dbname "$db" -q -f "$f" ;;
      *.sh) . "$f" ;;
    esac
  done
  pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  echo "postgres: database \"$db\" of user \"$user\" initialised in $PGDATA"
fi
shift
exec postgres -D "$PGDATA" "$@"
