// Lints deploy/Dockerfile offline: dockerfile-utils' validator (any error or warning fails),
// then the project's own rules for the image.
//   node deploy/lint/check-dockerfile.mjs --modules DIR/node_modules deploy/Dockerfile
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { parseArgs } from "node:util";

const { values, positionals } = parseArgs({
  options: { modules: { type: "string" } },
  allowPositionals: true,
});
if (!values.modules || positionals.length !== 1) {
  console.error("usage: check-dockerfile.mjs --modules NODE_MODULES DOCKERFILE");
  process.exit(2);
}
const require = createRequire(values.modules.replace(/\/?$/, "/"));
const { validate } = require("dockerfile-utils");
const { DockerfileParser } = require("dockerfile-ast");

const path = positionals[0];
const text = readFileSync(path, "utf8");
const problems = [];

for (const d of validate(text)) {
  const kind = d.severity === 1 ? "error" : "warning"; // LSP DiagnosticSeverity: 1 error, 2 warning
  problems.push(`line ${d.range.start.line + 1}: ${kind}: ${d.message}`);
}

// The base images are build arguments (ARG before the first FROM): the rules below check their
// defaults, which are what a plain `docker build` uses. Each FROM must name such an argument or a
// literal image; an ARG without a default in a FROM is a problem.
const parsed = DockerfileParser.parse(text);
const globalArgs = new Map();
const firstFrom = parsed.getFROMs()[0];
for (const arg of parsed.getInstructions().filter((i) => i.getKeyword() === "ARG")) {
  if (firstFrom && arg.getRange().start.line > firstFrom.getRange().start.line) continue;
  const [name, ...rest] = (arg.getArgumentsContent() ?? "").split("=");
  globalArgs.set(name.trim(), rest.length ? rest.join("=").trim() : undefined);
}
const resolved = text.split("\n").map((line) => {
  if (!/^\s*FROM\s/i.test(line)) return line;
  return line.replace(/\$\{(\w+)\}|\$(\w+)/g, (whole, braced, bare) => {
    const name = braced ?? bare;
    const value = globalArgs.get(name);
    if (value === undefined) {
      problems.push(`FROM uses \${${name}}, which has no default in an ARG before the first FROM`);
      return whole;
    }
    return value;
  });
}).join("\n");
const dockerfile = DockerfileParser.parse(resolved);
const stages = dockerfile.getFROMs();
const lineOf = (instruction) => instruction.getRange().start.line + 1;
const args = (instruction) => instruction.getArguments().map((a) => a.getValue());
const stageInstructions = (index) => {
  const start = lineOf(stages[index]);
  const end = index + 1 < stages.length ? lineOf(stages[index + 1]) : Infinity;
  return dockerfile.getInstructions().filter((i) => lineOf(i) >= start && lineOf(i) < end);
};
const check = (ok, message) => {
  if (!ok) problems.push(message);
};

check(stages.length >= 2, "expected a multi-stage build (a build stage and a runtime stage)");
if (stages.length >= 2) {
  const build = stages[0];
  const runtime = stages[stages.length - 1];
  const cuda = /^13\.0\.\d+-(devel|runtime)-ubuntu24\.04$/;
  check(build.getImageName() === "nvidia/cuda" && cuda.test(build.getImageTag() ?? "") &&
          build.getImageTag().includes("-devel-"),
        `line ${lineOf(build)}: the build stage must start FROM nvidia/cuda:13.0.x-devel-ubuntu24.04`);
  check(runtime.getImageName() === "nvidia/cuda" && cuda.test(runtime.getImageTag() ?? "") &&
          runtime.getImageTag().includes("-runtime-"),
        `line ${lineOf(runtime)}: the final stage must start FROM nvidia/cuda:13.0.x-runtime-ubuntu24.04`);
  check((build.getImageTag() ?? "").split("-")[0] === (runtime.getImageTag() ?? "").split("-")[0],
        "the build and runtime images must carry the same CUDA version");
  for (const from of stages) {
    const tag = from.getImageTag();
    const isStage = stages.some((s) => s.getBuildStage() === from.getImageName());
    check(isStage || (tag && tag !== "latest") || from.getImageDigest(),
          `line ${lineOf(from)}: base image ${from.getImage()} must be pinned to a tag or digest`);
  }

  const names = stages.map((s) => s.getBuildStage()).filter(Boolean);
  for (const copy of dockerfile.getInstructions().filter((i) => i.getKeyword() === "COPY")) {
    const from = copy.getFromFlag?.()?.getValue();
    if (from) check(names.includes(from), `line ${lineOf(copy)}: COPY --from=${from} names no stage`);
  }

  // One list of packages: every stage installs through deploy/install-deps.sh, never apt-get.
  const runs = (index) => stageInstructions(index).filter((i) => i.getKeyword() === "RUN");
  const runText = (index) => runs(index).map((r) => r.getArgumentsContent() ?? "").join("\n");
  check(/install-deps\.sh\s+--build-only\b/.test(runText(0)),
        "the build stage must install with deploy/install-deps.sh --build-only");
  check(/install-deps\.sh\s+--runtime\b/.test(runText(stages.length - 1)),
        "the runtime stage must install with deploy/install-deps.sh --runtime");
  for (const run of dockerfile.getInstructions().filter((i) => i.getKeyword() === "RUN")) {
    check(!/\bapt(-get)?\s+install\b/.test(run.getArgumentsContent() ?? ""),
          `line ${lineOf(run)}: install packages through deploy/install-deps.sh, not apt-get`);
  }

  const last = stageInstructions(stages.length - 1);
  const users = last.filter((i) => i.getKeyword() === "USER");
  const user = users.length ? args(users[users.length - 1])[0] : "root";
  check(!/^(root|0)(:|$)/.test(user), "the final stage must switch to a non-root USER");

  const exposed = last.filter((i) => i.getKeyword() === "EXPOSE").flatMap(args)
                      .map((p) => p.replace(/\/tcp$/, ""));
  for (const port of ["50051", "9464"]) {
    check(exposed.includes(port), `the final stage must EXPOSE ${port}`);
  }

  const healthchecks = last.filter((i) => i.getKeyword() === "HEALTHCHECK");
  check(healthchecks.length === 1, "the final stage needs one HEALTHCHECK");
  if (healthchecks.length === 1) {
    check(/pagedattn-health/.test(healthchecks[0].getArgumentsContent() ?? ""),
          `line ${lineOf(healthchecks[0])}: the HEALTHCHECK must run pagedattn-health`);
  }

  const entrypoints = last.filter((i) => i.getKeyword() === "ENTRYPOINT");
  check(entrypoints.length === 1 && /^\s*\[/.test(entrypoints[0].getArgumentsContent() ?? ""),
        "the final stage needs one ENTRYPOINT in exec (JSON) form, so the server gets SIGTERM");
  if (entrypoints.length === 1) {
    const entry = entrypoints[0].getArgumentsContent() ?? "";
    check(entry.includes("pagedattn-server"), "the ENTRYPOINT must start pagedattn-server");
    check(entry.includes("--grpc_address=0.0.0.0:50051") &&
            entry.includes("--metrics_address=0.0.0.0:9464"),
          "the server must listen on 0.0.0.0:50051 and 0.0.0.0:9464 in the container");
  }
}

if (problems.length) {
  for (const p of problems) console.error(`${path}: ${p}`);
  console.error(`${path}: ${problems.length} problem(s)`);
  process.exit(1);
}
console.log(`${path}: ok (${stages.length} stages)`);
