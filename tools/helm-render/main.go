// Command helm-render renders a Helm chart's templates offline, for tests.
//
// No helm binary can be installed on the development and CI machines, so this is a small
// stand-in built on Go's text/template, the sprig function library and re-implementations
// of the Helm-specific functions (include, tpl, toYaml, fromYaml, toJson, fromJson, required,
// lookup). It follows Helm's semantics where a chart can tell the difference:
//
//   - .Values is the chart's values.yaml coalesced with each -f file in order (maps merge
//     deeply, a null in a later file deletes the key), then round-tripped through JSON so that
//     every number is a float64, exactly as Helm hands them to templates;
//   - .Release, .Chart (from Chart.yaml), .Capabilities (KubeVersion, APIVersions.Has) and
//     .Template are populated; .Files is not supported;
//   - files whose base name starts with "_" only define templates; NOTES.txt is rendered but
//     printed only with -notes;
//   - -strict (the default) executes with missingkey=error, like `helm lint --strict`;
//   - a Chart.yaml kubeVersion constraint that -kube-version does not meet is an error, as in
//     `helm template --kube-version`.
//
// Output: every non-empty document, each preceded by "---" and a "# Source:" comment, as
// `helm template` prints it. Every document is parsed as YAML before it is printed.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/semver/v3"
	"github.com/Masterminds/sprig/v3"
	"gopkg.in/yaml.v3"
)

type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// ChartMeta mirrors the fields of Chart.yaml that templates read (.Chart.Name, ...).
type ChartMeta struct {
	APIVersion  string            `yaml:"apiVersion"`
	Name        string            `yaml:"name"`
	Version     string            `yaml:"version"`
	AppVersion  string            `yaml:"appVersion"`
	Description string            `yaml:"description"`
	Type        string            `yaml:"type"`
	KubeVersion string            `yaml:"kubeVersion"`
	Home        string            `yaml:"home"`
	Sources     []string          `yaml:"sources"`
	Keywords    []string          `yaml:"keywords"`
	Annotations map[string]string `yaml:"annotations"`
	Maintainers []map[string]any  `yaml:"maintainers"`
	Icon        string            `yaml:"icon"`
}

// KubeVersion mirrors .Capabilities.KubeVersion.
type KubeVersion struct {
	Version    string
	Major      string
	Minor      string
	GitVersion string
}

func (k KubeVersion) String() string { return k.Version }

// VersionSet mirrors .Capabilities.APIVersions.
type VersionSet []string

// Has reports whether the API version (group/version, or group/version/Kind) is known.
func (v VersionSet) Has(apiVersion string) bool {
	for _, x := range v {
		if x == apiVersion {
			return true
		}
	}
	return false
}

// Capabilities mirrors .Capabilities.
type Capabilities struct {
	KubeVersion KubeVersion
	APIVersions VersionSet
	HelmVersion map[string]string
}

// Release mirrors .Release.
type Release struct {
	Name      string
	Namespace string
	IsInstall bool
	IsUpgrade bool
	Revision  int
	Service   string
}

// builtinAPIVersions are the group/versions of a plain cluster that this chart may ask about.
var builtinAPIVersions = []string{
	"v1", "apps/v1", "batch/v1", "policy/v1", "autoscaling/v2", "networking.k8s.io/v1",
	"rbac.authorization.k8s.io/v1", "storage.k8s.io/v1", "scheduling.k8s.io/v1",
}

func main() {
	var valueFiles, apiVersions stringList
	chartDir := flag.String("chart", "", "chart directory (holds Chart.yaml, values.yaml, templates/)")
	flag.Var(&valueFiles, "f", "values file to merge over the chart's values.yaml (repeatable)")
	releaseName := flag.String("release-name", "kvxfer", ".Release.Name")
	namespace := flag.String("namespace", "default", ".Release.Namespace")
	kubeVersion := flag.String("kube-version", "1.30.0", ".Capabilities.KubeVersion (major.minor.patch)")
	flag.Var(&apiVersions, "api-versions", "extra .Capabilities.APIVersions entry (repeatable)")
	strict := flag.Bool("strict", true, "fail on a missing map key (missingkey=error)")
	notes := flag.Bool("notes", false, "also print the rendered NOTES.txt")
	flag.Parse()
	if *chartDir == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: helm-render -chart DIR [-f values.yaml]... [-api-versions G/V]...")
		os.Exit(2)
	}
	out, err := render(*chartDir, valueFiles, *releaseName, *namespace, *kubeVersion, apiVersions, *strict, *notes)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helm-render:", err)
		os.Exit(1)
	}
	fmt.Print(out)
}

func render(chartDir string, valueFiles []string, releaseName, namespace, kubeVersion string,
	apiVersions []string, strict, notes bool) (string, error) {
	var meta ChartMeta
	if err := readYAML(filepath.Join(chartDir, "Chart.yaml"), &meta); err != nil {
		return "", err
	}
	if meta.Name == "" || meta.Version == "" {
		return "", errors.New("Chart.yaml needs name and version")
	}
	values := map[string]any{}
	files := append([]string{filepath.Join(chartDir, "values.yaml")}, valueFiles...)
	for _, f := range files {
		var v map[string]any
		if err := readYAML(f, &v); err != nil {
			return "", err
		}
		values = coalesce(values, v)
	}
	values, err := jsonRoundTrip(values)
	if err != nil {
		return "", err
	}
	kv := strings.SplitN(strings.TrimPrefix(kubeVersion, "v"), ".", 3)
	if len(kv) < 2 {
		return "", fmt.Errorf("bad -kube-version %q", kubeVersion)
	}
	if meta.KubeVersion != "" {
		if err := checkKubeVersion(meta.KubeVersion, kubeVersion); err != nil {
			return "", err
		}
	}
	caps := Capabilities{
		KubeVersion: KubeVersion{Version: "v" + strings.TrimPrefix(kubeVersion, "v"), Major: kv[0], Minor: kv[1],
			GitVersion: "v" + strings.TrimPrefix(kubeVersion, "v")},
		APIVersions: append(append(VersionSet{}, builtinAPIVersions...), apiVersions...),
		HelmVersion: map[string]string{"Version": "v3.16.0-helm-render"},
	}
	top := map[string]any{
		"Values":       values,
		"Chart":        meta,
		"Release":      Release{Name: releaseName, Namespace: namespace, IsInstall: true, Revision: 1, Service: "Helm"},
		"Capabilities": caps,
	}

	// Collect templates: every file under templates/ (recursively), sorted for stable output.
	tplDir := filepath.Join(chartDir, "templates")
	var names []string
	sources := map[string]string{}
	err = filepath.Walk(tplDir, func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(chartDir, p)
		name := meta.Name + "/" + filepath.ToSlash(rel)
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		names = append(names, name)
		sources[name] = string(b)
		return nil
	})
	if err != nil {
		return "", err
	}
	sort.Strings(names)

	t := template.New("gotpl")
	if strict {
		t.Option("missingkey=error")
	} else {
		t.Option("missingkey=zero")
	}
	t.Funcs(funcMap(t))
	for _, n := range names {
		if _, err := t.New(n).Parse(sources[n]); err != nil {
			return "", err
		}
	}

	var out strings.Builder
	var notesOut string
	sep := regexp.MustCompile(`(?m)^---[ \t]*$`)
	for _, n := range names {
		base := filepath.Base(n)
		if strings.HasPrefix(base, "_") {
			continue
		}
		data := shallowCopy(top)
		data["Template"] = map[string]any{"Name": n, "BasePath": meta.Name + "/templates"}
		var buf bytes.Buffer
		if err := t.ExecuteTemplate(&buf, n, data); err != nil {
			return "", err
		}
		text := buf.String()
		if !strict {
			text = strings.ReplaceAll(text, "<no value>", "")
		}
		if base == "NOTES.txt" {
			notesOut = text
			continue
		}
		for i, doc := range sep.Split(text, -1) {
			if isBlankDoc(doc) {
				continue
			}
			var node yaml.Node
			if err := yaml.Unmarshal([]byte(doc), &node); err != nil {
				return "", fmt.Errorf("%s: document %d is not valid YAML: %v\n%s", n, i, err, numbered(doc))
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", n, strings.Trim(doc, "\n"))
		}
	}
	if notes && notesOut != "" {
		fmt.Fprintf(&out, "\nNOTES:\n%s\n", notesOut)
	}
	return out.String(), nil
}

// checkKubeVersion refuses a cluster version outside the chart's kubeVersion range, with Helm's
// message.
func checkKubeVersion(constraint, kubeVersion string) error {
	c, err := semver.NewConstraint(constraint)
	if err != nil {
		return fmt.Errorf("Chart.yaml kubeVersion %q: %w", constraint, err)
	}
	v, err := semver.NewVersion(kubeVersion)
	if err != nil {
		return fmt.Errorf("bad -kube-version %q: %w", kubeVersion, err)
	}
	if !c.Check(v) {
		return fmt.Errorf("chart requires kubeVersion: %s which is incompatible with Kubernetes v%s",
			constraint, strings.TrimPrefix(kubeVersion, "v"))
	}
	return nil
}

func funcMap(t *template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	// Helm removes these two: charts must not read the environment of the machine rendering them.
	delete(f, "env")
	delete(f, "expandenv")
	includedNames := map[string]int{}
	f["include"] = func(name string, data any) (string, error) {
		if includedNames[name] > 1000 {
			return "", fmt.Errorf("rendering template has a nested reference name: %s", name)
		}
		includedNames[name]++
		defer func() { includedNames[name]-- }()
		var buf bytes.Buffer
		if err := t.ExecuteTemplate(&buf, name, data); err != nil {
			return "", err
		}
		return buf.String(), nil
	}
	f["tpl"] = func(text string, data any) (string, error) {
		c, err := t.Clone()
		if err != nil {
			return "", err
		}
		c.Funcs(funcMap(c))
		if _, err := c.New("tpl-inline").Parse(text); err != nil {
			return "", fmt.Errorf("tpl: %w", err)
		}
		var buf bytes.Buffer
		if err := c.ExecuteTemplate(&buf, "tpl-inline", data); err != nil {
			return "", fmt.Errorf("tpl: %w", err)
		}
		return strings.ReplaceAll(buf.String(), "<no value>", ""), nil
	}
	f["required"] = func(msg string, v any) (any, error) {
		if v == nil {
			return v, errors.New(msg)
		}
		if s, ok := v.(string); ok && s == "" {
			return v, errors.New(msg)
		}
		return v, nil
	}
	f["toYaml"] = func(v any) string { s, _ := toYAML(v); return s }
	f["mustToYaml"] = toYAML
	f["fromYaml"] = func(s string) map[string]any {
		var m map[string]any
		if err := yaml.Unmarshal([]byte(s), &m); err != nil {
			return map[string]any{"Error": err.Error()}
		}
		m2, err := jsonRoundTrip(m)
		if err != nil {
			return map[string]any{"Error": err.Error()}
		}
		if m2 == nil {
			m2 = map[string]any{}
		}
		return m2
	}
	f["fromYamlArray"] = func(s string) []any {
		var a []any
		if err := yaml.Unmarshal([]byte(s), &a); err != nil {
			return []any{err.Error()}
		}
		b, _ := json.Marshal(a)
		var out []any
		_ = json.Unmarshal(b, &out)
		return out
	}
	f["toJson"] = func(v any) string { b, _ := json.Marshal(v); return string(b) }
	f["mustToJson"] = func(v any) (string, error) { b, err := json.Marshal(v); return string(b), err }
	f["fromJson"] = func(s string) map[string]any {
		m := map[string]any{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			m["Error"] = err.Error()
		}
		return m
	}
	f["fromJsonArray"] = func(s string) []any {
		var a []any
		if err := json.Unmarshal([]byte(s), &a); err != nil {
			return []any{err.Error()}
		}
		return a
	}
	// lookup talks to a live cluster in Helm; `helm template` returns an empty map too.
	f["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]any, error) {
		return map[string]any{}, nil
	}
	return f
}

// toYAML encodes like Helm's toYaml (sigs.k8s.io/yaml: through JSON, keys sorted, two-space
// indents, numbers as JSON writes them), without the trailing newline.
func toYAML(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", err
	}
	var node yaml.Node
	if err := yaml.Unmarshal(b, &node); err != nil {
		return "", err
	}
	plainStyle(&node)
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&node); err != nil {
		return "", err
	}
	_ = enc.Close()
	return strings.TrimSuffix(buf.String(), "\n"), nil
}

// plainStyle drops the JSON flow and quoting styles so the encoder picks YAML's block style
// and quotes only where a plain scalar would change type.
func plainStyle(n *yaml.Node) {
	if n.Kind == yaml.MappingNode || n.Kind == yaml.SequenceNode {
		if len(n.Content) > 0 {
			n.Style = 0
		}
	} else if n.Kind == yaml.ScalarNode {
		n.Style = 0
	}
	for _, c := range n.Content {
		plainStyle(c)
	}
}

// coalesce merges src over dst like Helm's values coalescing: maps merge recursively, any
// other value replaces, and an explicit null deletes the key.
func coalesce(dst, src map[string]any) map[string]any {
	if dst == nil {
		dst = map[string]any{}
	}
	for k, sv := range src {
		if sv == nil {
			delete(dst, k)
			continue
		}
		sm, sIsMap := sv.(map[string]any)
		dm, dIsMap := dst[k].(map[string]any)
		if sIsMap && dIsMap {
			dst[k] = coalesce(dm, sm)
		} else {
			dst[k] = sv
		}
	}
	return dst
}

func jsonRoundTrip(m map[string]any) (map[string]any, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("values are not JSON-compatible: %w", err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
	}
	return out, nil
}

func readYAML(path string, into any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := yaml.Unmarshal(b, into); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func shallowCopy(m map[string]any) map[string]any {
	out := make(map[string]any, len(m)+1)
	for k, v := range m {
		out[k] = v
	}
	return out
}

func isBlankDoc(doc string) bool {
	for _, line := range strings.Split(doc, "\n") {
		s := strings.TrimSpace(line)
		if s != "" && !strings.HasPrefix(s, "#") {
			return false
		}
	}
	return true
}

func numbered(doc string) string {
	var b strings.Builder
	for i, line := range strings.Split(doc, "\n") {
		fmt.Fprintf(&b, "%4d | %s\n", i+1, line)
	}
	return b.String()
}
