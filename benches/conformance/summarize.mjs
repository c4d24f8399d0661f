// Counts a cache-tests result file the way cache-tests.fyi does: every test's
// verdict comes from the suite's own `determineTestResult`, with dependencies
// honoured (a test whose `depends_on` did not pass is "dependency", not "fail").
// Usage:
//   node summarize.mjs RESULTS.json [--suite DIR] [--failing]
// DIR is the suite that made RESULTS.json: a checkout of its repository (verdicts in
// test-engine/lib/results.mjs) or the npm package `http-cache-tests` 0.4.5 (verdicts
// in lib/display.mjs, and the surrogate-control tests, which its cli.mjs adds). By
// default, the package installed beside this file.
import fs from 'fs'
import path from 'path'
import { fileURLToPath, pathToFileURL } from 'url'

const here = path.dirname(fileURLToPath(import.meta.url))
const args = process.argv.slice(2)
const at = args.indexOf('--suite')
const suite = at >= 0 ? path.resolve(args[at + 1]) : path.join(here, 'node_modules', 'http-cache-tests')
const load = p => import(pathToFileURL(path.join(suite, p)).href)
const isRepository = fs.existsSync(path.join(suite, 'test-engine', 'lib', 'results.mjs'))

const { default: tests } = await load('tests/index.mjs')
let determineTestResult
if (isRepository) {
  ({ determineTestResult } = await load('test-engine/lib/results.mjs'))
} else {
  ({ determineTestResult } = await load('lib/display.mjs'))
  const { default: surrogate } = await load('tests/surrogate-control.mjs')
  tests.push(surrogate) // the package's cli.mjs runs these too
}

const file = args.find((a, i) => !a.startsWith('--') && args[i - 1] !== '--suite')
const listFailing = args.includes('--failing')
const results = JSON.parse(fs.readFileSync(file, 'utf8'))

// determineTestResult returns one of the suite's resultTypes; its third element is
// the console symbol, which names the verdict.
const verdicts = {
  '✅': 'pass',
  '⛔️': 'fail',
  '⚠️': 'optional_fail',
  Y: 'yes',
  N: 'no',
  '🔹': 'setup_fail',
  '⁉️': 'harness_fail',
  '⚪️': 'dependency',
  '↻': 'retry',
  '-': 'untested'
}
const verdictOf = id => verdicts[determineTestResult(tests, id, results)[2]]

const count = () => ({ total: 0 })
const byKind = { required: count(), optimal: count(), check: count() }
const notPassing = [] // required tests that did not pass, and optional ones that failed
for (const group of tests) {
  for (const test of group.tests) {
    if (test.browser_only === true) continue // not run against proxies
    const verdict = verdictOf(test.id)
    const kind = test.kind || 'required'
    const c = byKind[kind]
    c.total++
    c[verdict] = (c[verdict] || 0) + 1
    const listed = kind === 'required' ? verdict !== 'pass' : ['optional_fail', 'dependency', 'setup_fail', 'harness_fail', 'retry'].includes(verdict)
    if (listed && kind !== 'check') {
      const r = results[test.id]
      let why = Array.isArray(r) ? r[1] : ''
      if (verdict === 'dependency') {
        const unmet = test.depends_on.filter(d => !['pass', 'yes'].includes(verdictOf(d)))
        why = `depends on ${unmet.join(', ')}` + (why ? `; its own result: ${why}` : '')
      }
      notPassing.push({ group: group.id, id: test.id, kind, verdict, name: test.name, why })
    }
  }
}

const line = (label, c) => {
  const order = ['pass', 'fail', 'optional_fail', 'yes', 'no', 'dependency', 'setup_fail', 'harness_fail', 'retry', 'untested']
  const parts = order.filter(k => c[k]).map(k => `${k} ${c[k]}`)
  return `${label.padEnd(9)} ${String(c.total).padStart(3)} tests: ${parts.join(', ')}`
}
console.log(line('required', byKind.required))
console.log(line('optimal', byKind.optimal))
console.log(line('check', byKind.check))
const r = byKind.required
const o = byKind.optimal
const other = c => (c.setup_fail || 0) + (c.harness_fail || 0) + (c.retry || 0) + (c.untested || 0)
console.log(`summary: required ${r.pass || 0}/${r.total} passed, ${r.fail || 0} failed, ${r.dependency || 0} dependency, ${other(r)} setup/harness/retry/untested; ` +
  `optional ${o.optional_fail || 0} failed, ${o.dependency || 0} dependency, ${other(o)} setup/harness/retry/untested`)
if (listFailing) {
  for (const [kind, title] of [['required', 'required tests not passing'], ['optimal', 'optional tests failing']]) {
    const list = notPassing.filter(f => f.kind === kind)
    console.log(`\n${title} (${list.length}; dependency = a test it depends on did not pass):`)
    let group
    for (const f of list) {
      if (f.group !== group) { group = f.group; console.log(`  [${group}]`) }
      console.log(`    ${f.verdict.padEnd(13)} ${f.id} — ${f.name}${f.why ? `\n                  ${f.why}` : ''}`)
    }
  }
}
