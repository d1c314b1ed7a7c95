// Checks deploy/k8s offline: every document parses, validates against the Kubernetes schema of
// its kind (kubernetes-models), and the objects carry what pagedattn needs (one GPU per pod,
// gRPC probes, a headless Service that selects the pods, a PodDisruptionBudget, resource
// requests, Prometheus scrape annotations, a grace period longer than the drain).
//   node deploy/lint/check-k8s.mjs --modules DIR/node_modules deploy/k8s
import { readFileSync, readdirSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";
import { parseArgs } from "node:util";

const { values, positionals } = parseArgs({
  options: { modules: { type: "string" } },
  allowPositionals: true,
});
if (!values.modules || positionals.length !== 1) {
  console.error("usage: check-k8s.mjs --modules NODE_MODULES K8S_DIR");
  process.exit(2);
}
const require = createRequire(values.modules.replace(/\/?$/, "/"));
const yaml = require("js-yaml");
const models = {
  "v1/Namespace": require("kubernetes-models/v1/Namespace").Namespace,
  "v1/Service": require("kubernetes-models/v1/Service").Service,
  "apps/v1/Deployment": require("kubernetes-models/apps/v1/Deployment").Deployment,
  "policy/v1/PodDisruptionBudget":
    require("kubernetes-models/policy/v1/PodDisruptionBudget").PodDisruptionBudget,
};

const dir = positionals[0];
const problems = [];
const check = (ok, message) => {
  if (!ok) problems.push(message);
};

const files = readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort();
const objects = [];
let kustomization = null;
for (const file of files) {
  let docs;
  try {
    docs = yaml.loadAll(readFileSync(join(dir, file), "utf8"));
  } catch (e) {
    problems.push(`${file}: YAML: ${e.message}`);
    continue;
  }
  for (const doc of docs.filter((d) => d != null)) {
    const key = `${doc.apiVersion}/${doc.kind}`;
    if (doc.kind === "Kustomization") {
      kustomization = { file, doc };
      continue;
    }
    const Model = models[key];
    if (!Model) {
      problems.push(`${file}: ${key} is not a kind this check knows; add its model`);
      continue;
    }
    try {
      new Model(doc).validate();
    } catch (e) {
      problems.push(`${file}: ${doc.kind} ${doc.metadata?.name}: schema: ${e.message}`);
    }
    objects.push({ file, doc });
  }
}

const ofKind = (kind) => objects.filter((o) => o.doc.kind === kind);
const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
const namespaces = new Set(ofKind("Namespace").map((o) => o.doc.metadata.name));
for (const { file, doc } of objects.filter((o) => o.doc.kind !== "Namespace")) {
  check(doc.metadata?.namespace && namespaces.has(doc.metadata.namespace),
        `${file}: ${doc.kind} ${doc.metadata?.name} must be in a namespace declared here`);
}

const deployments = ofKind("Deployment");
check(deployments.length === 1, "expected one Deployment");
for (const { file, doc } of deployments) {
  const where = `${file}: Deployment ${doc.metadata.name}`;
  const pod = doc.spec.template;
  const labels = pod.metadata?.labels ?? {};
  check(matches(doc.spec.selector?.matchLabels, labels) &&
          Object.keys(doc.spec.selector?.matchLabels ?? {}).length > 0,
        `${where}: spec.selector must match the pod template's labels`);
  check((doc.spec.strategy?.rollingUpdate?.maxSurge ?? 1) === 0 ||
          doc.spec.strategy?.type === "Recreate",
        `${where}: rollouts must not surge (a new pod needs the GPU the old one holds)`);

  const annotations = pod.metadata?.annotations ?? {};
  check(annotations["prometheus.io/scrape"] === "true",
        `${where}: pod annotation prometheus.io/scrape must be "true"`);
  check(annotations["prometheus.io/path"] === "/metrics",
        `${where}: pod annotation prometheus.io/path must be /metrics`);

  check(pod.spec.securityContext?.runAsNonRoot === true, `${where}: pods must run as non-root`);
  const containers = pod.spec.containers ?? [];
  check(containers.length === 1, `${where}: expected one container`);
  for (const c of containers) {
    const cw = `${where} container ${c.name}`;
    const ports = Object.fromEntries((c.ports ?? []).map((p) => [p.name, p.containerPort]));
    check(ports.grpc === 50051, `${cw}: needs a port named grpc, 50051`);
    check(ports.metrics === 9464, `${cw}: needs a port named metrics, 9464`);
    check(String(annotations["prometheus.io/port"]) === String(ports.metrics),
          `${cw}: prometheus.io/port must be the metrics port`);

    const res = c.resources ?? {};
    check(String(res.limits?.["nvidia.com/gpu"]) === "1",
          `${cw}: resources.limits["nvidia.com/gpu"] must be 1 (one replica per GPU)`);
    check(res.requests?.cpu && res.requests?.memory, `${cw}: needs cpu and memory requests`);
    check(res.limits?.memory, `${cw}: needs a memory limit`);

    const grpcProbe = (probe, service) => {
      if (!probe) return false;
      if (probe.grpc) return probe.grpc.port === 50051 && (probe.grpc.service ?? "") === service;
      const cmd = probe.exec?.command ?? [];
      return cmd[0]?.endsWith("pagedattn-health") &&
             (cmd.find((a) => a.startsWith("--service="))?.slice(10) ?? "") === service;
    };
    check(grpcProbe(c.readinessProbe, "pagedattn.v1.PagedAttention"),
          `${cw}: readinessProbe must ask the health service for pagedattn.v1.PagedAttention`);
    check(grpcProbe(c.livenessProbe, ""),
          `${cw}: livenessProbe must ask the health service for the server ("")`);

    const args = c.args ?? [];
    const backend = args.find((a) => a.startsWith("--backend="));
    check(backend === "--backend=cuda", `${cw}: a GPU replica must run --backend=cuda`);
    check(!c.command, `${cw}: keep the image's ENTRYPOINT (it sets the listen addresses)`);
    const drain = args.find((a) => a.startsWith("--drain_timeout="));
    const seconds = drain ? Number(drain.match(/=(\d+)s$/)?.[1]) : NaN;
    check(Number.isFinite(seconds), `${cw}: set --drain_timeout=Ns`);
    check((pod.spec.terminationGracePeriodSeconds ?? 30) > seconds,
          `${where}: terminationGracePeriodSeconds must exceed --drain_timeout`);
  }

  const services = ofKind("Service").filter((s) => matches(s.doc.spec.selector, labels));
  check(services.length >= 1, `${where}: no Service selects its pods`);
  for (const { file: sf, doc: svc } of services) {
    const sw = `${sf}: Service ${svc.metadata.name}`;
    check(svc.spec.clusterIP === "None", `${sw}: must be headless (clusterIP: None)`);
    check(!svc.spec.publishNotReadyAddresses, `${sw}: must not publish not-ready pods`);
    const names = new Set(containers.flatMap((c) => (c.ports ?? []).map((p) => p.name)));
    for (const p of svc.spec.ports ?? []) {
      check(typeof p.targetPort !== "string" || names.has(p.targetPort),
            `${sw}: port ${p.name} targets ${p.targetPort}, which no container port is named`);
    }
    check((svc.spec.ports ?? []).some((p) => p.port === 50051), `${sw}: must expose 50051`);
  }

  const pdbs = ofKind("PodDisruptionBudget").filter((p) =>
    matches(p.doc.spec.selector?.matchLabels, labels));
  check(pdbs.length === 1, `${where}: expected one PodDisruptionBudget selecting its pods`);
  for (const { file: pf, doc: pdb } of pdbs) {
    check(pdb.spec.maxUnavailable !== undefined || pdb.spec.minAvailable !== undefined,
          `${pf}: the PodDisruptionBudget needs maxUnavailable or minAvailable`);
  }
}

if (!kustomization) {
  problems.push("no kustomization.yaml");
} else {
  const listed = new Set(kustomization.doc.resources ?? []);
  for (const file of files.filter((f) => f !== kustomization.file)) {
    check(listed.has(file), `${kustomization.file}: does not list ${file}`);
  }
  for (const file of listed) check(files.includes(file), `${kustomization.file}: lists missing ${file}`);
}

if (problems.length) {
  for (const p of problems) console.error(`${dir}: ${p}`);
  console.error(`${dir}: ${problems.length} problem(s)`);
  process.exit(1);
}
console.log(`${dir}: ok (${objects.length} objects in ${files.length} files)`);
