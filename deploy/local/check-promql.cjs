// Parses PromQL expressions with Prometheus' own grammar (@prometheus-io/lezer-promql, the
// parser of Prometheus' web UI) and reports the ones that do not parse.
// usage: node check-promql.cjs NODE_MODULES_DIR < expressions.json   (a JSON array of strings)
// Prints one line per bad expression (the expression and the offsets of the errors); exit 1 if any.
"use strict";
const path = require("path");
const { parser } = require(path.join(process.argv[2], "@prometheus-io/lezer-promql"));

let input = "";
process.stdin.on("data", (d) => (input += d));
process.stdin.on("end", () => {
  const exprs = JSON.parse(input);
  let bad = 0;
  for (const expr of exprs) {
    const errors = [];
    parser.parse(expr).iterate({
      enter: (n) => {
        if (n.type.isError) errors.push(n.from);
      },
    });
    if (errors.length > 0) {
      bad += 1;
      console.log(`does not parse (at ${errors.join(", ")}): ${expr}`);
    }
  }
  console.log(`${exprs.length - bad} of ${exprs.length} expressions parse`);
  process.exit(bad > 0 ? 1 : 0);
});
