// Counts a cache-tests result file the way cache-tests.fyi does: every test's
// verdict comes from the suite's own `determineTestResult` (lib/display.mjs),
// with dependencies honoured (a test whose `depends_on` did not pass is
// "dependency", not "fail"). Usage:
//   node summarize.mjs RESULTS.json [--failing]
// Run from benches/conformance/ (it imports the installed package).
import fs from 'fs'
import path from 'path'
import { fileURLToPath, pathToFileURL } from 'url'

const here = path.dirname(fileURLToPath(import.meta.url))
const pkg = path.join(here, 'node_modules', 'http-cache-tests')
const load = p => import(pathToFileURL(path.join(pkg, p)).href)

const { default: tests } = await load('tests/index.mjs')
const { default: surrogate } = await load('tests/surrogate-control.mjs')
const display = await load('lib/display.mjs')
tests.push(surrogate) // cli.mjs runs these too

const file = process.argv[2]
const listFailing = process.argv.includes('--failing')
const results = JSON.parse(fs.readFileSync(file, 'utf8'))

// determineTestResult returns one of display.mjs's resultTypes; its third
// element is the console symbol, which names the verdict.
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

const count = () => ({ total: 0 })
const required = count()
const all = count()
const failingRequired = []
for (const suite of tests) {
  for (const test of suite.tests) {
    if (test.browser_only === true) continue // not run against proxies
    const verdict = verdicts[display.determineTestResult(tests, test.id, results)[2]]
    const kind = test.kind || 'required'
    for (const c of kind === 'required' ? [required, all] : [all]) {
      c.total++
      c[verdict] = (c[verdict] || 0) + 1
    }
    if (kind === 'required' && verdict !== 'pass') {
      const r = results[test.id]
      let why = Array.isArray(r) ? r[1] : ''
      if (verdict === 'dependency') {
        const unmet = test.depends_on.filter(d => !['pass', 'yes'].includes(verdicts[display.determineTestResult(tests, d, results)[2]]))
        why = `depends on ${unmet.join(', ')}` + (why ? `; its own result: ${why}` : '')
      }
      failingRequired.push({ suite: suite.id, id: test.id, verdict, name: test.name, why })
    }
  }
}

const line = (label, c) => {
  const order = ['pass', 'fail', 'optional_fail', 'yes', 'no', 'dependency', 'setup_fail', 'harness_fail', 'retry', 'untested']
  const parts = order.filter(k => c[k]).map(k => `${k} ${c[k]}`)
  return `${label.padEnd(9)} ${String(c.total).padStart(3)} tests: ${parts.join(', ')}`
}
console.log(line('required', required))
console.log(line('all', all))
console.log(`summary: required ${required.pass || 0}/${required.total} passed, ${required.fail || 0} failed, ${required.dependency || 0} dependency, ${(required.setup_fail || 0) + (required.harness_fail || 0) + (required.retry || 0) + (required.untested || 0)} setup/harness/retry/untested`)
if (listFailing) {
  console.log('\nrequired tests not passing (dependency = a test it depends on did not pass):')
  let suite
  for (const f of failingRequired) {
    if (f.suite !== suite) { suite = f.suite; console.log(`  [${suite}]`) }
    console.log(`    ${f.verdict.padEnd(10)} ${f.id} — ${f.name}${f.why ? `\n               ${f.why}` : ''}`)
  }
}
