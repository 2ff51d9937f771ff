#!/usr/bin/env python
"""Make a small certificate authority and one TLS certificate for a dtrain / Dask cluster.

    python examples/make_certs.py OUT_DIR [--host 127.0.0.1] [--host scheduler.example.org] ...

writes, into OUT_DIR:

    ca.pem         the CA certificate: give it to every process (--tls-ca-file, cluster.security.ca_file)
    ca-key.pem     the CA's private key: keep it off the cluster (only needed to sign more certificates)
    cluster.pem    a certificate signed by the CA, valid as TLS server *and* client, with every --host
                   as a subject alternative name (IP addresses and DNS names)
    cluster-key.pem  its private key (mode 0600)

One certificate shared by the scheduler, the workers and the `dtrain run` client is the simplest
setup (it is what `distributed.Security.temporary()` does); mint one per role with --name when you
want to revoke them separately. Dask verifies that the peer's certificate was signed by the CA; it
does not check host names, but listing them keeps the certificate valid for other TLS clients.

Needs the `cryptography` package (`pip install cryptography`). See docs/deployment.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_ca(days: int = 365, common_name: str = "dtrain cluster CA") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_cert(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, hosts: list[str], days: int = 365
              ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--host", action="append", default=[],
                   help="IP address or DNS name to put in the certificate (repeatable; default 127.0.0.1)")
    p.add_argument("--name", default="cluster", help="file stem of the certificate (default: cluster)")
    p.add_argument("--days", type=int, default=365)
    args = p.parse_args(argv)
    hosts = args.host or ["127.0.0.1"]
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    if (out / "ca.pem").exists() and (out / "ca-key.pem").exists():
        ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
        ca_key = serialization.load_pem_private_key((out / "ca-key.pem").read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            print(f"{out / 'ca-key.pem'}: not an EC key made by this script", file=sys.stderr)
            return 2
    else:
        ca, ca_key = make_ca(args.days)
        _write_cert(out / "ca.pem", ca)
        _write_key(out / "ca-key.pem", ca_key)
    cert, key = make_cert(ca, ca_key, hosts, args.days)
    _write_cert(out / f"{args.name}.pem", cert)
    _write_key(out / f"{args.name}-key.pem", key)
    print(f"wrote {out / 'ca.pem'}, {out / f'{args.name}.pem'} and {out / f'{args.name}-key.pem'} "
          f"for {', '.join(hosts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
